"""docs/pipeline.md's first example runs on 4 ranks (as the launcher runs it, on a pooled
world: tests/pooled_launch.py) and prints the single-process losses."""
import os
import re

import torch
import torch.nn.functional as F

from pooled_launch import run_launched

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example() -> str:
    with open(os.path.join(ROOT, "docs", "pipeline.md")) as f:
        return re.search(r"```python\n(.*?)```", f.read(), re.S).group(1)


def _single_process_losses():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(8)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)
    losses = []
    for _ in range(3):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_pipeline_page_example_runs_and_matches_one_process(tmp_path):
    script = tmp_path / "pipeline_example.py"
    script.write_text(_example())
    out = "".join(run_launched(str(script), 4, []))
    got = [float(v) for v in re.findall(r"step \d: loss ([0-9.]+)", out)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(_single_process_losses()), rtol=1e-5, atol=1e-6)
    assert "rank 3: F0 B0 F1 B1 F2 B2" in out and "idle ms (bubble)" in out
