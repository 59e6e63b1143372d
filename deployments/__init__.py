"""Work pools, deployments, schedules, triggers, blocks and limits on a Prefect server
(`draftsmith prefect setup`)."""
