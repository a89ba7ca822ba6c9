"""raykv behind Ray Serve (the extra ``serve``): a KV-aware request router that ranks replicas
by expected time to first token from raykv's prefix index (``RaykvRouter``), and the
application ``raykv serve`` runs: vLLM replicas with ``RaykvConnector`` behind it."""
