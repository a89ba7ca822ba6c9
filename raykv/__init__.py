"""raykv: a distributed KV-cache service for LLM inference, built on Ray."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `raykv.connect` / `raykv.Client` import Ray only when used, so `import raykv` stays light.
    if name in ("connect", "Client", "AsyncClient"):
        from raykv.service.control.ray_join import prepare_auth

        prepare_auth()  # before Ray is imported: it reads the auth mode once
        from raykv import client

        return getattr(client, name)
    if name in ("LookupResult", "LoadResult", "StoreResult"):  # what the client's calls return
        from raykv import api

        return getattr(api, name)
    raise AttributeError(f"module 'raykv' has no attribute {name!r}")
