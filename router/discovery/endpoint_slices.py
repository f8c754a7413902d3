"""What an EndpointSlice says about workers: the routable `host:port` addresses in it.

Plain functions over `kubernetes.client.V1EndpointSlice`-shaped objects (attribute access
only), so the rules are read and tested without an API server.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

APP_LABEL = "app.kubernetes.io/name"
ROLE_LABEL = "baton.io/role"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # set on every slice by the EndpointSlice controller


def role_selector(role: str, app: str = "baton") -> str:
    """The default label selector for one role's EndpointSlices."""
    return f"{APP_LABEL}={app},{ROLE_LABEL}={role}"


def service_selector(service_name: str) -> str:
    """The label selector for the EndpointSlices of one Service."""
    return f"{SERVICE_NAME_LABEL}={service_name}"


def routable_addresses(endpoint_slice, port_name: str) -> frozenset[str]:
    """`host:port` of every endpoint that is ready (unset counts as ready) and not terminating."""
    port = slice_port(endpoint_slice, port_name)
    if port is None:
        return frozenset()
    addresses = set()
    for endpoint in endpoint_slice.endpoints or []:
        conditions = endpoint.conditions
        if conditions is not None and (conditions.ready is False or conditions.terminating is True):
            continue
        if endpoint.addresses:  # the API says addresses are fungible; clients may use the first
            addresses.add(join_host_port(endpoint.addresses[0], port))
    return frozenset(addresses)


def slice_port(endpoint_slice, port_name: str) -> int | None:
    """The port named `port_name`, else the slice's only port; None (and a warning) otherwise."""
    ports = [port for port in endpoint_slice.ports or [] if port.port is not None]
    named = [port.port for port in ports if port.name == port_name]
    if named:
        return named[0]
    if len(ports) == 1:
        return ports[0].port
    log.warning("EndpointSlice %s has no port named %r and %d other ports; its endpoints are skipped. "
                "Name the workers' Service port %r.", endpoint_slice.metadata.name, port_name, len(ports),
                port_name, extra={"endpoint_slice": endpoint_slice.metadata.name, "port_name": port_name})
    return None


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
