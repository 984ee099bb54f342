"""The tether console: one web UI over the stores the CLI reads (run directories, the agent journal, the
gateway's keys and ledger, the job store, sandbox servers' `/metrics`), with live views over server-sent
events. `create_app` builds it; `tether console` serves it."""
