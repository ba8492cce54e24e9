"""Engine side: the engine, its weight loaders, memory plan, rank workers and HTTP server."""
