"""Writes dashboards/specmesh.json (the provisioned Grafana dashboard): python deploy/grafana/gen_dashboard.py"""
import json
RI = "$__rate_interval"
B = 'specmesh_bucket=~"$bucket"'
def q(expr, legend): return {"expr": expr, "legendFormat": legend, "datasource": {"type": "prometheus", "uid": "prometheus"}}
def quant(metric, job, by="specmesh_bucket", qs=(0.5, 0.95, 0.99)):
    return [q(f'histogram_quantile({p}, sum by (le, {by}) (rate({metric}_bucket{{job="{job}", {B}}}[{RI}])))',
              f"P{int(p*100)} {{{{{by}}}}}") for p in qs]
panels = []
def panel(title, targets, unit, desc, stack=False):
    i = len(panels)
    panels.append({"id": i + 1, "type": "timeseries", "title": title, "description": desc,
                   "datasource": {"type": "prometheus", "uid": "prometheus"},
                   "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i // 2) * 8},
                   "fieldConfig": {"defaults": {"unit": unit, "custom": {"stacking": {"mode": "normal" if stack else "none"}}}, "overrides": []},
                   "options": {"legend": {"displayMode": "table", "placement": "right"}, "tooltip": {"mode": "multi"}},
                   "targets": [dict(t, refId=chr(65 + k)) for k, t in enumerate(targets)]})
panel("TTFT P50/P95/P99 per bucket (router)", quant("gen_ai_server_time_to_first_token_seconds", "router"), "s",
      "Time to first token as the caller sees it, per request bucket.")
panel("TPOT P50/P95/P99 per bucket (router)", quant("gen_ai_server_time_per_output_token_seconds", "router"), "s",
      "Time per output token after the first, per bucket.")
panel("End-to-end P50/P99 per bucket (router)", quant("gen_ai_server_request_duration_seconds", "router", qs=(0.5, 0.99)), "s",
      "Arrival to last token.")
panel("Acceptance length per bucket", [q(f'sum by (specmesh_bucket) (rate(specmesh_speculation_acceptance_length_sum{{{B}}}[{RI}])) / sum by (specmesh_bucket) (rate(specmesh_speculation_acceptance_length_count{{{B}}}[{RI}]))', "{{specmesh_bucket}}")], "none",
      "Accepted + bonus tokens per verify pass (τ).")
panel("Rejected draft tokens/s per bucket", [q(f'sum by (specmesh_bucket) (rate(specmesh_speculation_rejected_tokens_total{{{B}}}[{RI}]))', "{{specmesh_bucket}}")], "short",
      "Draft tokens the target verified and threw away: wasted verify compute.")
panel("Verify time P50/P99 per bucket", quant("specmesh_speculation_verify_time_seconds", "target", qs=(0.5, 0.99)), "s",
      "Verify forward pass per speculating sequence and pass.")
panel("Draft fallbacks/s per bucket", [q(f'sum by (specmesh_bucket) (rate(specmesh_speculation_fallbacks_total{{{B}}}[{RI}]))', "{{specmesh_bucket}}")], "short",
      "Steps that decoded without a draft because it failed or was late.")
panel("Route distribution (requests/s by pool)", [q(f'sum by (specmesh_pool) (rate(specmesh_router_routes_total[{RI}]))', "{{specmesh_pool}}"),
      q(f'sum by (specmesh_bucket) (rate(specmesh_router_upgrades_total[{RI}])) / sum by (specmesh_bucket) (rate(specmesh_router_escalation_candidates_total[{RI}]))', "upgrade rate {{specmesh_bucket}}")], "short",
      "Where the router sends requests; upgrade rate = escalations / requests on pools that may escalate.", stack=False)
panel("KV blocks used / cached / free", [q("sum by (specmesh_model) (specmesh_kv_blocks_used)", "used {{specmesh_model}}"),
      q("sum by (specmesh_model) (specmesh_kv_blocks_cached)", "cached {{specmesh_model}}"),
      q("sum by (specmesh_model) (specmesh_kv_blocks_free)", "free {{specmesh_model}}")], "short",
      "Paged KV pool of every target replica.")
panel("Prefix-cache hit rate", [q(f'sum(rate(specmesh_prefix_hit_tokens_total[{RI}])) / sum(rate(specmesh_prefix_query_tokens_total[{RI}]))', "hit rate")], "percentunit",
      "Prompt tokens served from the prefix cache / prompt tokens looked up.")
panel("Requests/s by status (router)", [q(f'sum by (specmesh_status) (rate(specmesh_requests_total{{job="router"}}[{RI}]))', "{{specmesh_status}}")], "reqps",
      "Finished requests by gRPC status.", stack=True)
panel("Queue time P50/P99 per bucket (target)", quant("specmesh_request_queue_time_seconds", "target", qs=(0.5, 0.99)), "s",
      "Arrival to admission into the running batch.")
dash = {"uid": "specmesh-slo", "title": "specmesh — per-bucket SLOs", "schemaVersion": 39, "version": 1,
        "time": {"from": "now-30m", "to": "now"}, "refresh": "10s", "tags": ["specmesh"],
        "templating": {"list": [{"name": "bucket", "type": "query", "label": "bucket",
                                  "datasource": {"type": "prometheus", "uid": "prometheus"},
                                  "query": "label_values(gen_ai_server_time_to_first_token_seconds_bucket, specmesh_bucket)",
                                  "definition": "label_values(gen_ai_server_time_to_first_token_seconds_bucket, specmesh_bucket)",
                                  "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*",
                                  "current": {"text": "All", "value": "$__all"}}]},
        "panels": panels}
open(__import__("pathlib").Path(__file__).parent / "dashboards" / "specmesh.json", "w").write(json.dumps(dash, indent=1) + "\n")
