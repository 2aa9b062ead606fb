// A real OpenID provider for the test suite: the `oidc-provider` package (pinned in package.json), with its
// own people, passwords and groups and its own login page. Configured by the environment so the Python
// harness (tests/idp/harness.py) can start several, each on its own loopback port:
//   IDP_PORT     the port to listen on (127.0.0.1; 0 or unset: any free one)
//   IDP_ISSUER   the issuer (unset: http://127.0.0.1:PORT)
//   IDP_CLIENTS  JSON list of {client_id, client_secret, redirect_uris, grant_types}
//   IDP_JWKS     JSON {"keys": [private JWKs]}: the signing keys (the harness keeps them to forge tokens)
//   IDP_USERS    JSON {login: {password, groups, email, name}}
//   IDP_DEVICE_INTERVAL  seconds between a device's polls, said in the device authorization (unset: 5)
// It prints "listening <issuer>" once it answers; the harness still waits for discovery to answer.
import http from 'node:http';
import Provider from 'oidc-provider';

const env = (name, fallback) => process.env[name] ?? fallback;
const port = Number(env('IDP_PORT', '0')); // 0: any free port, named in the issuer once listening
const clients = JSON.parse(env('IDP_CLIENTS', '[]')).map((c) => ({
  client_id: c.client_id,
  client_secret: c.client_secret,
  redirect_uris: c.redirect_uris ?? [],
  grant_types: c.grant_types ?? ['authorization_code', 'urn:ietf:params:oauth:grant-type:device_code'],
  response_types: (c.grant_types ?? ['authorization_code']).includes('authorization_code') ? ['code'] : [],
  token_endpoint_auth_method: 'client_secret_basic',
}));
const jwks = process.env.IDP_JWKS ? JSON.parse(process.env.IDP_JWKS) : undefined;
const users = JSON.parse(env('IDP_USERS', '{}'));
const deviceInterval = Number(env('IDP_DEVICE_INTERVAL', '0')); // the device flow's polling interval (0: unsaid, 5 s)

const escape = (s) => String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

const configuration = {
  clients,
  ...(jwks ? { jwks } : {}),
  cookies: { keys: ['llmgw-test-idp-cookie-key'] },
  claims: {
    openid: ['sub'],
    profile: ['preferred_username', 'name'],
    email: ['email'],
    groups: ['groups'],
  },
  scopes: ['openid', 'profile', 'email', 'groups', 'offline_access'],
  features: {
    devInteractions: { enabled: false }, // its login takes any password; ours checks it
    deviceFlow: {
      enabled: true,
      // Plain pages of our own (the package's defaults load a web font from the internet).
      async userCodeInputSource(ctx, form, _out, err) {
        const message = err ? `<p role="alert" id="error">${err.userCode ? 'The code is not valid.' : 'Something went wrong.'}</p>` : '';
        // The package's form holds the code's input (name="user_code").
        ctx.body = page('Enter the code', `${message}<label for="user_code">Code</label>${form}
<button type="submit" id="submit" form="op.deviceInputForm">Continue</button>`);
      },
      async userCodeConfirmSource(ctx, form, client, _deviceInfo, userCode) {
        ctx.body = page('Confirm the device', `<p>${escape(client.clientId)} asks to sign you in. The device shows
<code id="user_code">${escape(userCode)}</code>.</p>${form}
<button type="submit" id="confirm" form="op.deviceConfirmForm">Continue</button>
<button type="submit" id="abort" form="op.deviceConfirmForm" value="yes" name="abort">Abort</button>`);
      },
      async successSource(ctx) {
        ctx.body = page('Signed in', '<p id="done">You are signed in on your device; you may close this window.</p>');
      },
    },
    userinfo: { enabled: true },
  },
  pkce: { required: () => true },
  async findAccount(_ctx, sub) {
    const user = users[sub];
    if (!user) return undefined;
    return {
      accountId: sub,
      async claims() {
        return {
          sub,
          preferred_username: sub,
          name: user.name ?? sub,
          email: user.email ?? `${sub}@example.org`,
          groups: user.groups ?? [],
        };
      },
    };
  },
  // First-party clients: no consent page; every scope and claim asked for is granted.
  async loadExistingGrant(ctx) {
    const grantId = ctx.oidc.result?.consent?.grantId || ctx.oidc.session.grantIdFor(ctx.oidc.client.clientId);
    if (grantId) {
      const found = await ctx.oidc.provider.Grant.find(grantId);
      if (found) return found;
    }
    const grant = new ctx.oidc.provider.Grant({
      clientId: ctx.oidc.client.clientId,
      accountId: ctx.oidc.session.accountId,
    });
    grant.addOIDCScope('openid profile email groups');
    grant.addOIDCClaims(['preferred_username', 'name', 'email', 'groups']);
    await grant.save();
    return grant;
  },
  interactions: {
    url(_ctx, interaction) {
      return `/interaction/${interaction.uid}`;
    },
  },
  ttl: { Session: 3600, Interaction: 600, Grant: 3600, AccessToken: 600, IdToken: 600, DeviceCode: 600 },
};

let provider; // made once listening: the issuer names the port

function page(title, body) {
  return `<!doctype html><html lang="en"><head><meta charset="utf-8"><title>${escape(title)}</title></head>
<body><h1>${escape(title)}</h1>${body}</body></html>`;
}

function loginPage(uid, message) {
  return `<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Test IdP sign-in</title></head>
<body><h1>Test identity provider</h1>
${message ? `<p role="alert" id="error">${escape(message)}</p>` : ''}
<form method="post" action="/interaction/${escape(uid)}/login">
<label>Username <input name="login" id="login" autocomplete="username" autofocus></label>
<label>Password <input name="password" id="password" type="password" autocomplete="current-password"></label>
<button type="submit" id="submit">Sign in</button>
</form>
<form method="post" action="/interaction/${escape(uid)}/abort"><button type="submit" id="abort">Cancel</button></form>
</body></html>`;
}

async function readForm(req) {
  const chunks = [];
  for await (const chunk of req) chunks.push(chunk);
  return new URLSearchParams(Buffer.concat(chunks).toString('utf8'));
}

async function interaction(req, res, path) {
  const [, , uid, action] = path.split('/');
  try {
    const details = await provider.interactionDetails(req, res);
    if (details.uid !== uid) throw new Error('interaction uid mismatch');
    if (req.method === 'GET' && !action) {
      res.writeHead(200, { 'content-type': 'text/html; charset=utf-8' });
      res.end(loginPage(uid, ''));
      return;
    }
    if (req.method === 'POST' && action === 'login') {
      const form = await readForm(req);
      const login = form.get('login') ?? '';
      const user = users[login];
      if (!user || user.password !== (form.get('password') ?? '')) {
        res.writeHead(200, { 'content-type': 'text/html; charset=utf-8' });
        res.end(loginPage(uid, 'Invalid username or password.'));
        return;
      }
      await provider.interactionFinished(req, res, { login: { accountId: login } }, { mergeWithLastSubmission: false });
      return;
    }
    if (req.method === 'POST' && action === 'abort') {
      await readForm(req);
      await provider.interactionFinished(
        req,
        res,
        { error: 'access_denied', error_description: 'the person cancelled the sign-in' },
        { mergeWithLastSubmission: false },
      );
      return;
    }
    res.writeHead(404).end();
  } catch (err) {
    res.writeHead(400, { 'content-type': 'text/plain; charset=utf-8' });
    res.end(`interaction failed: ${err.message}`);
  }
}

let callback;
const server = http.createServer((req, res) => {
  const path = new URL(req.url, 'http://127.0.0.1').pathname;
  if (path.startsWith('/interaction/')) {
    interaction(req, res, path);
    return;
  }
  callback(req, res);
});
server.listen(port, '127.0.0.1', () => {
  const issuer = env('IDP_ISSUER', `http://127.0.0.1:${server.address().port}`);
  provider = new Provider(issuer, configuration);
  if (deviceInterval > 0) {
    provider.use(async (ctx, next) => {
      await next();
      if (ctx.path === '/device/auth' && ctx.status === 200 && ctx.body) ctx.body = { ...ctx.body, interval: deviceInterval };
    });
  }
  callback = provider.callback();
  console.log(`listening ${issuer}`);
});
const stop = () => {
  server.close(() => process.exit(0));
  server.closeAllConnections(); // kept-alive connections would hold close() open (node 18 does not end idle ones)
};
process.on('SIGTERM', stop);
process.on('SIGINT', stop);
