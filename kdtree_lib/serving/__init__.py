"""The live service: a client that benchmarks an SGLang endpoint (`serving.client`: requests, the
sweep, rows in serving.csv) and this engine served with the same endpoints (`serving.engine`: the
queue, decode batches and the decode thread; `serving.server`: the HTTP layer; run by
`python -m kdtree_lib.serve`), so the client is tested against a real server process."""
