"""The address other nodes reach a server at."""


def advertised_host(bind_host: str) -> str:
    """`bind_host` itself, or this node's IP (as Ray knows it) for a server bound to every interface."""
    if bind_host in ("0.0.0.0", "::", ""):
        import ray

        return ray.util.get_node_ip_address()
    return bind_host
