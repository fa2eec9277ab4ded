"""The agent-facing REST API (Django REST Framework): tools, runs, actions, health.

Views validate input, call one service of the engine and serialise its answer; reads go through
`ledger.api.selectors`. Every refusal is an RFC 9457 problem (`ledger.api.problems`).
"""
