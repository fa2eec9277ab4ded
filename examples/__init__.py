"""Runnable examples of agents that put their tool calls through Unwind (see examples/agent_loop.py)."""
