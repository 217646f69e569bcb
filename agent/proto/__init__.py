"""gRPC protocol between the runtime and the agent."""
