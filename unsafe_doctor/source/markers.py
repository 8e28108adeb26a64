"""The comment lines around each block unsafe-doctor writes into an adaptor.

Kept apart from `adaptor` (which loads libcst) so that `audit` can recognise its own blocks
without that cost."""

MARKER_BEGIN = "# unsafe-doctor: begin "
MARKER_END = "# unsafe-doctor: end "
# The key of the sentinel's block (`unsafe-doctor sentinel install`). A rule id has no `_` and a fix
# key for a named global has a `:`, so no fix block can take this key.
SENTINEL_KEY = "unsafe_doctor.sentinel"
