"""The UCX route (``ucx``): host <-> host over ucxx, optional (``raykv[ucx]`` and a transport
secret). A member serves its blocks from a ``UcxServer`` (``server``) and readers fetch them
with ``UcxTransport`` (``reader``), both on this process's ucxx loop (``runtime``), speaking
``wire``'s messages, configured from the node's environment (``config``)."""

from raykv.transport.ucx.config import UcxConfig
from raykv.transport.ucx.reader import UcxTransport, ucx_reader
from raykv.transport.ucx.server import ucx_server

__all__ = ["UcxConfig", "UcxTransport", "ucx_reader", "ucx_server"]
