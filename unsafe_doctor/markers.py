"""The comment lines around each block unsafe-doctor writes into an adaptor.

Kept apart from `adaptor` (which loads libcst) so that `audit` can recognise its own blocks
without that cost."""

MARKER_BEGIN = "# unsafe-doctor: begin "
MARKER_END = "# unsafe-doctor: end "
