"""Router: public gRPC API, routing policy, global prefix index, discovery and the large-batch planner."""
