"""runstats: running loss statistics kept on the device between steps, one per marker shape."""
