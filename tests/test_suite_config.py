"""The suite's own guards are in force: pytest-timeout is installed (make setup) and applies
pytest.ini's timeout, so a hung test fails instead of blocking CI."""


def test_pytest_timeout_is_active(request):
    assert request.config.pluginmanager.hasplugin("timeout"), \
        "pytest-timeout is not installed: pytest.ini's timeout would be ignored"
    assert float(request.config.getini("timeout")) == 900
    marker_timeout = request.config.getoption("timeout", default=None)
    assert marker_timeout is None or float(marker_timeout) > 0
