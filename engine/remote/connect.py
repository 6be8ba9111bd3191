"""open_transport(host): the transport for a host (local, or SSH through Fabric when used)."""

from __future__ import annotations

from .inventory import Host
from .transport import LocalTransport, Transport


def open_transport(host: Host, *, accept_new_host_key: bool = False) -> Transport:
    """The transport for `host`; SSH hosts are connected (and their host key checked) here."""
    if host.transport == "local":
        return LocalTransport(host)
    from .ssh import SshTransport  # lazily: Fabric / Paramiko only when an SSH host is used
    return SshTransport(host, accept_new_host_key=accept_new_host_key)
