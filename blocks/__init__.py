"""Prefect blocks (endpoints, secrets, storage, GPU host settings).

None exist yet: the local pipeline needs none. The distributed setup (issue 7) adds the
inference-endpoint and GPU-host blocks here.
"""
