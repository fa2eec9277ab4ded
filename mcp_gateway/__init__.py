"""Unwind as an MCP server: an agent's MCP client lists the tenant's tools and calls them through runs."""
