"""unsafe-doctor: find, explain and fix the global tensor that MindIO recovery left unsafe."""

__version__ = "0.1.0"
