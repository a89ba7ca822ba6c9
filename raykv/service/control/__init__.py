"""The control plane: the named, detached ``Coordinator`` (membership, served models, the
cluster-wide prefix index and its change feed), where its members go (``placement``), the
index's pieces (``index``), the cluster's ``status`` and ``metrics``, the admin key
(``admin``), the bounded calls drivers make to it (``calls``) and ``raykv up / status / down``
(``launcher``, joining a Ray cluster in ``ray_join``).

Imports nothing of the pools' or tiers' code at module level: ``placement`` loads the actor
classes only when it places them.
"""
