"""The coordinator: ``DataParallelInferenceCoordinator`` (Megatron-Core's interface) over its
parts — config, transport, admission, the request table, the engine registry, dispatch, the
batch step (intake, results), membership, control and status. See docs/architecture.md."""

from dpserve.coordinator.config import CoordinatorConfig
from dpserve.coordinator.coordinator import DataParallelInferenceCoordinator
from dpserve.coordinator.routing import RoutingPolicy
from dpserve.protocol import ControlState

__all__ = ["ControlState", "CoordinatorConfig", "DataParallelInferenceCoordinator", "RoutingPolicy"]
