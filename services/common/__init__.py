"""What every Loopline service shares: settings base, logging, gRPC server, database, errors."""
