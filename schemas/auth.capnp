@0x8f8236dc759377d9;
# The bootstrap capability of every Cap'n Proto port of a node (the `Node` API of api.capnp on
# the RPC port, `Admin` of admin.capnp on the admin port). A client first trades an API key for
# the port's real capability; nothing else is reachable before that. See docs/security.md.
$import "/capnp/c++.capnp".namespace("tandem::auth");

interface Gate {
  # Returns the port's capability (cast it to api.Node or admin.Admin) if `key` is one of the
  # node's API keys, or anything when the node runs without keys (auth off). A wrong or missing
  # key fails with a `failed` exception naming the fix.
  authenticate @0 (key :Text) -> (cap :Capability);
}
