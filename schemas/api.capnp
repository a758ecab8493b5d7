@0xfc0037b7556face4;
# External RPC API of a node: generate (streaming to a client callback), abort, health, stats.
$import "/capnp/c++.capnp".namespace("tandem::api");
