"""Transport between learners and the syncer: protocol, wire format, client."""
