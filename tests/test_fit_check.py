"""``QSyncCallback(check_fit=True)``: before step 1, the step's symbolic peak against the memory
budget and the device's memory, with a plan that would fit (`qsync_callback/fit_check.py`), in real
Lightning runs."""

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from qsync_callback import QSyncCallback
from qsync_callback.fit_check import DoesNotFit, check_fit, device_memory_bytes
from qsync_callback.plan import Constraints

BATCH, WIDTH, HIDDEN, CLASSES, DEPTH = 64, 128, 512, 10, 4


class Deep(pl.LightningModule):
    """Residual blocks of two Linear layers: activations a recompute plan can free."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(WIDTH, HIDDEN)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN))
            for _ in range(DEPTH)
        )
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class ByHand(Deep):
    """Optimizes by hand: a symbolic step cannot run it, so the fit cannot be checked."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _fit(model, callback, steps=3, precision="32-true"):
    x, y = (torch.cat([t] * steps) for t in _batch())
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        precision=precision,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    return trainer


@pytest.fixture(scope="module")
def peak():
    return check_fit(Deep(), _batch(), Constraints()).peak_bytes


def test_a_budget_under_the_symbolic_peak_warns_names_a_plan_and_training_goes_on(tmp_path, peak):
    budget = peak - 300_000  # recomputing two of the four blocks frees that
    callback = QSyncCallback(mode="record", output_dir=tmp_path, memory_budget=budget, check_fit=True)
    with pytest.warns(UserWarning, match="is over the memory budget") as caught:
        trainer = _fit(Deep(), callback)
    assert trainer.global_step == 3
    message = next(str(w.message) for w in caught if "memory budget" in str(w.message))
    assert "a plan that fits:" in message and "recompute" in message
    check = callback.fit_check
    assert check.peak_bytes == peak and not check.fits and check.limits["the memory budget"] == budget


def test_strict_stops_the_run_before_its_first_step(tmp_path, peak):
    model = Deep()
    before = [p.detach().clone() for p in model.parameters()]
    callback = QSyncCallback(
        mode="record", output_dir=tmp_path, memory_budget=peak // 10, check_fit=True, strict=True
    )
    with pytest.raises(DoesNotFit, match="is over the memory budget"):
        _fit(model, callback)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # no step ran


def test_a_step_that_fits_says_so_and_a_share_budget_is_not_checked_before_a_recording(tmp_path, peak):
    callback = QSyncCallback(mode="record", output_dir=tmp_path, memory_budget="85%", check_fit=True)
    _fit(Deep(), callback)
    check = callback.fit_check
    assert check.fits and check.peak_bytes == peak
    assert list(check.limits) == ["the device's memory (cpu)"]
    assert check.limits["the device's memory (cpu)"] == device_memory_bytes("cpu") > peak
    assert "share of the recorded peak" in check.message()


def test_a_module_the_check_cannot_trace_warns_once_and_trains(tmp_path):
    callback = QSyncCallback(mode="record", output_dir=tmp_path, memory_budget="1GB", check_fit=True)
    with pytest.warns(UserWarning, match="could not check the fit before step 1.*by hand"):
        trainer = _fit(ByHand(), callback)
    assert trainer.global_step == 3 and callback.fit_check is None


def test_without_the_activation_lever_no_plan_is_looked_for(peak):
    check = check_fit(Deep(), _batch(), Constraints(memory_budget=peak // 2, levers=("precision",)))
    assert not check.fits and "activation lever is not allowed" in check.plan_text


def test_the_check_traces_the_step_at_the_trainers_precision(tmp_path, peak):
    """Under ``Trainer(precision="bf16-mixed")`` the checked step is the autocast one: its peak is
    the symbolic bf16-mixed step's, not the fp32 one's."""
    callback = QSyncCallback(mode="record", output_dir=tmp_path, memory_budget="1GB", check_fit=True)
    _fit(Deep(), callback, precision="bf16-mixed")
    mixed = check_fit(Deep(), _batch(), Constraints(), precision="bf16-mixed").peak_bytes
    assert callback.fit_check.peak_bytes == mixed != peak
