import os

import torch
from hypothesis import HealthCheck, settings

# A fixed, derandomised budget keeps CI time bounded and failures reproducible.
settings.register_profile(
    "attnkit",
    deadline=None,
    max_examples=int(os.environ.get("ATTNKIT_HYPOTHESIS_EXAMPLES", "25")),
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("attnkit")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
