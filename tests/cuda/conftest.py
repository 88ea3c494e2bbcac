"""`product_route`, for the CUDA case files' tests of linear maps: each runs once per route of
the products that tests/support/cuda_target.py lists for the target (the tiled kernel; and cuBLAS
on a GPU), with PYML_CUDA_PRODUCTS set for the test. Only the case files' child processes ask for
it, so the main session never imports cuda_target (which sets Numba's simulator switch). Nothing
here imports pyml.package at collection, which imports numba: a case file's first import must
come before numba's."""

import pytest


def pytest_generate_tests(metafunc):
    if "product_route" in metafunc.fixturenames:
        from tests.support.cuda_target import PRODUCT_ROUTES

        metafunc.parametrize("product_route", PRODUCT_ROUTES, indirect=True)


@pytest.fixture
def product_route(request, monkeypatch):
    from pyml.package.cuda_products import SWITCH

    monkeypatch.setenv(SWITCH, request.param)
    return request.param
