"""attnkit.apps.forecast at its QUICK size: the CO2 series as shipped, the seasonal-naive baseline,
the forecast loop, the lag measure, and the run's report and checkpoint."""

from __future__ import annotations

import pytest
import torch

from attnkit.apps import forecast
from tests.viz.test_report import app_report_problems


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("forecast")
    return forecast.run(out=out, quick=True, progress=False), out


def test_the_monthly_series_is_whole_and_seasonal():
    months, co2 = forecast.co2_monthly()
    assert months[0] == "196405" and months[-1] == "200112" and len(months) == len(co2) == 452
    # One month after another, none missing.
    as_index = [int(m[:4]) * 12 + int(m[4:]) for m in months]
    assert as_index == list(range(as_index[0], as_index[0] + len(months)))
    assert 315 < co2[0] < 325 and 365 < co2[-1] < 375
    # The yearly cycle: May is the peak, autumn the trough, every year.
    may = co2[0::12]
    october = co2[5::12]
    assert (may[:len(october)] > october).all()


def test_seasonal_naive_repeats_last_year_and_errors_are_what_they_say():
    series = torch.arange(40, dtype=torch.float64)
    pred = forecast.seasonal_naive(series, range(24, 27), horizon=3)
    assert pred.tolist() == [[12, 13, 14], [13, 14, 15], [14, 15, 16]]
    mae, rmse = forecast.errors(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 0.0]))
    assert mae == 2.0 and rmse == pytest.approx(5 ** 0.5)


def test_forecast_feeds_each_month_back_in():
    class Last(torch.nn.Module):  # "predicts" each month as the one before plus one (scaled units)
        def forward(self, x):
            return x + 1.0

    out = forecast.forecast(Last(), torch.tensor([[10.0, 11.0, 12.0]], dtype=torch.float64), scale=2.0, horizon=3)
    assert out.tolist() == [[14.0, 16.0, 18.0]]


def test_the_season_ratio_leaves_the_anchor_out():
    flat = torch.full((48,), 1 / 48)
    assert forecast.season_ratio(flat) == pytest.approx(1.0)
    anchored = flat.clone()
    anchored[-1] = 0.5  # the window's first month: not a season
    assert forecast.season_ratio(anchored) == pytest.approx(1.0)
    seasonal = flat.clone()
    seasonal[11] = seasonal[23] = 0.1  # lags 12 and 24
    assert forecast.season_ratio(seasonal) > 2 and forecast.season_ratio(seasonal, within=1) > 1


def test_the_run_reports_errors_for_every_model_and_the_attention(trained):
    result, out = trained
    m = result.metrics
    assert m["origins"] == forecast.TEST_MONTHS - forecast.HORIZON + 1
    for key in ("transformer MAE", "lstm MAE", "naive MAE"):
        assert m[key] > 0
    assert m["naive MAE"] == pytest.approx(1.569, abs=5e-4)  # no training: the data's own figure
    assert m["season ratio layer 1"] > 0 and 1 <= m["peak lag layer 1"] <= forecast.DEFAULTS["context"]
    assert [p.name for s in result.sections for p in s.images] == ["forecast.png", "forecast_attention.png"]
    assert app_report_problems(result) == []
    model = forecast.load(out)
    assert model.scale > 0
    _, co2 = forecast.co2_monthly()
    ctx = co2[-60:-12][None]
    again = forecast.forecast(model, ctx, model.scale)
    assert again.shape == (1, forecast.HORIZON) and torch.isfinite(again).all()
