"""The engine's side runs in processes that never join Ray (``raykv.engine``): it and the
service modules it uses (``raykv.service.node.agent_protocol``, ``node.replica``, ``groups``,
``served``) import no Ray, also after the service's packages moved."""

from __future__ import annotations

import subprocess
import sys


def test_the_engine_side_imports_no_ray() -> None:
    code = (
        "import sys, raykv.engine, raykv.service.node.agent_protocol, "
        "raykv.service.node.replica, raykv.service.groups, raykv.service.served; "
        "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
