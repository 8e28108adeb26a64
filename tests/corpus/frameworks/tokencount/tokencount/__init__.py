"""tokencount: a trainer that reports tokens per second from a device-side token counter."""
