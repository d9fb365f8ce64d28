"""The specdec command line (main), the one-machine launcher of specdec serve and the client of a running front (generate --server)."""
