"""The version file of a megatron-core 0.7.0 checkout, as --source-root shows it (only the numbers)."""

MAJOR = 0
MINOR = 7
PATCH = 0
PRE_RELEASE = ''
