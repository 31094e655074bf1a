"""One training attempt: its directory layout, set-up, resume, the update loop and its hooks,
checkpoint cadence and writer, stopping, faults, events and result (see ``train``)."""
