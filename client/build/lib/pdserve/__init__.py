"""pdserve's client side: the public gRPC API (``pdserve.v1``, generated from
``proto/pdserve/v1/generate.proto`` by ``deploy/gen_proto.sh``; never edited by hand).

A separate small distribution (``client/pyproject.toml``) so applications can install it
without torch or ray. The sync and asyncio SDK clients are the rest of issue 5.
"""
