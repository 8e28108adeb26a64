"""The version file of a megatron-core 0.12.1 checkout, as --source-root shows it (only the numbers)."""

MAJOR = 0
MINOR = 12
PATCH = 1
PRE_RELEASE = ''
