"""Policy: tool policy documents, the ordering law, argument schemas, the in-process tool registry, display and describe, and policy versions."""
