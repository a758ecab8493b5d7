@0xf38861b72eb303ba;
# Messages between actors (router, schedulers, worker, cache tier). Every actor message is
# one of these structs, serialized; the same bytes cross nodes later.
$import "/capnp/c++.capnp".namespace("tandem::schema");
