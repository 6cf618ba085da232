"""servelm on Ray Serve (`servelm serve --ray`; needs `pip install servelm[ray]`): the same API, the same
config file, with each deployment's engine replicated over the nodes of a Ray cluster.

    HTTP → Ray Serve proxy → ingress (servelm's ASGI app: auth, limits, templates, tokenizing, metrics)
         → RemoteEngine → DeploymentHandle → PrefixAffinityRouter → ModelReplica (one LocalEngine each)

- application.py  the Ray Serve application built from the deployment specs, and running it
- ingress.py      the ingress deployment: servelm.http's app over RemoteEngines (tokenizer-only models);
                  /health and /metrics ask the replicas as they are read
- remote.py       RemoteEngine / RemoteEmbedder: the Engine protocol over a deployment's replicas; retries
- router.py       PrefixAffinityRouter: a Ray Serve RequestRouter that sends a prompt where its prefix is cached
- prefix_table.py block hashes of prompts → the replicas that were sent them (pure data)
- replica.py      ModelReplica: one replica, one engine built by servelm.compose
- served_by.py    the `x-servelm-replica` response header; a request's calls to replicas, cancelled with it

Nothing outside this package imports Ray; nothing here is imported unless `--ray` is asked for.
"""
