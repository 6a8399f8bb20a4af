"""`specmesh bench`: open-loop load against a router, per-bucket latency reports and plots."""
