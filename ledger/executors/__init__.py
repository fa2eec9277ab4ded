"""How tools are reached: HTTP, in-process Python, MCP upstreams, the egress allow-list and request signing."""
