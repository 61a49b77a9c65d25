"""One machine: the launcher of a decoupled run and the supervisor that restarts its children."""
