"""The parts of comet's cost model, each documenting what it models, in the order they build on
each other (a part imports only parts before it): hardware, fp8, shape, tp, gemm, one_node, nodes,
comm, pipeline, backward. The public face is comet.tune.perfmodel: use it, not these modules."""
