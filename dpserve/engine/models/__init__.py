"""One module per architecture, each a ``base.PagedModel`` over ``engine.layers``; ``registry``
maps a transformers ``model_type`` to its class."""
