"""The HTTP surface between the orchestrator, the router and the policy servers: paths and headers.

Both sides import these names: the orchestrator's client (rl.orchestrator.client) tags routed requests
with a session header, the router (rl.inference.router) routes those paths and fans the others out to
every server. Torch-free.
"""
SESSION_HEADER = "X-Session-Id"        # one rollout's turns share it: the router keeps them on one server
BACKEND_HEADER = "X-Hetrl-Backend"     # which server answered (responses)
PREFILL_HEADER = "X-Hetrl-Prefill"     # which prefill server ran the prefill leg (P/D responses)
# Generation: routed to one server.
ROUTED_PATHS = ("/inference/v1/generate", "/v1/completions", "/v1/chat/completions")
# Engine control: fanned out to every server.
FANOUT_PATHS = ("/pause", "/resume", "/collective_rpc", "/update_weight_version", "/reset_prefix_cache",
                "/sleep", "/wake_up")
ROUTER_RESET_INDEX = "/router/reset_index"
