#!/usr/bin/env sh
# Tools the test suite uses beyond Python wheels: promtool (Debian's `prometheus` package) checks the
# alert rules and runs their unit tests (tests/test_alert_rules.py); the same package's `prometheus`
# scrapes the fault suite's cluster and fires those alerts (tests/faults/prometheus.py). Installed
# when missing and this machine can (root, or sudo without a password, with apt); otherwise say how,
# and the tests that need it are skipped with that reason.
# Chromium (Debian's `chromium` package) is the browser Playwright drives in the console's tests
# (tests/browser/); Playwright never downloads a browser of its own. Installed the same way, else skipped.
if ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=none; fi
  else
    SUDO=none
  fi
  if [ "$SUDO" != none ]; then
    echo "installing chromium (Debian's package) for the console's browser tests"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 \
      || { $SUDO apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends chromium >/dev/null 2>&1; } \
      || echo "warning: could not install chromium; the console's browser tests will be skipped"
  else
    echo "note: chromium not found; install Debian's 'chromium' package (or set LLMGW_TEST_CHROMIUM to a Chromium or Chrome binary) to run the console's browser tests"
  fi
fi
# Node (Debian's `nodejs` and `npm`) runs the test OpenID provider (tests/idp: the `oidc-provider` package
# pinned in its package.json and package-lock.json), installed by `npm ci` when its node_modules is missing.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=none; fi
  else
    SUDO=none
  fi
  if [ "$SUDO" != none ]; then
    echo "installing node (Debian's nodejs and npm) for the OpenID Connect tests"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends nodejs npm >/dev/null 2>&1 \
      || { $SUDO apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends nodejs npm >/dev/null 2>&1; } \
      || echo "warning: could not install nodejs and npm; the OpenID Connect tests will be skipped"
  else
    echo "note: node not found; install Debian's 'nodejs' and 'npm' packages to run the OpenID Connect tests"
  fi
fi
IDP_DIR="$(dirname "$0")/../tests/idp"
if command -v npm >/dev/null 2>&1 && [ -f "$IDP_DIR/package-lock.json" ] && [ ! -d "$IDP_DIR/node_modules/oidc-provider" ]; then
  echo "installing the test OpenID provider's npm packages (tests/idp)"
  npm ci --prefix "$IDP_DIR" --no-audit --no-fund >/dev/null 2>&1 \
    || echo "warning: npm ci in tests/idp failed; the OpenID Connect tests will be skipped"
fi
# OpenLDAP (Debian's `slapd` and `ldap-utils`) is the directory the LDAP sign-in tests run themselves
# (tests/ldapd/: their own config on a free port; the package's own instance is never used).
if ! { command -v slapd >/dev/null 2>&1 || [ -x /usr/sbin/slapd ]; } || ! command -v ldapmodify >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=none; fi
  else
    SUDO=none
  fi
  if [ "$SUDO" != none ]; then
    echo "installing slapd and ldap-utils (Debian's OpenLDAP) for the LDAP sign-in tests"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends slapd ldap-utils >/dev/null 2>&1 \
      || { $SUDO apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends slapd ldap-utils >/dev/null 2>&1; } \
      || echo "warning: could not install slapd and ldap-utils; the LDAP sign-in tests will be skipped"
  else
    echo "note: slapd not found; install Debian's 'slapd' and 'ldap-utils' packages to run the LDAP sign-in tests"
  fi
fi
command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 && exit 0
if command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=none; fi
  if [ "$SUDO" != none ]; then
    echo "installing promtool (Debian's prometheus package) for the alert-rule tests"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1 \
      || { $SUDO apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1; } \
      || echo "warning: could not install prometheus (promtool); the alert-rule tests will be skipped"
    exit 0
  fi
fi
echo "note: promtool not found; install Debian's 'prometheus' package (or put promtool on PATH) to run the alert-rule tests"
