"""Generated code of the ``pdserve.v1`` public API (see ``proto/pdserve/v1/generate.proto``)."""
