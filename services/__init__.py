from services.common.grpc_defaults import apply as _apply_grpc_defaults

_apply_grpc_defaults()
