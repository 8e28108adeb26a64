"""toytrain: a deliberately small data-parallel training package used by unsafe-doctor's samples."""
