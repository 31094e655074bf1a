"""Running workers: the supervisor, multi-process launch and start-up, GPU leases and locks."""
