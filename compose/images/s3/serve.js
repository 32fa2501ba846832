// s3rver with the stack's own credentials (S3_ACCESS_KEY / S3_SECRET_KEY) instead of its
// built-in S3RVER/S3RVER pair, and the stack's bucket (S3_BUCKET) created at start.
// Objects are files under /data (a named volume): they survive a restart.
'use strict';
const S3rver = require('s3rver');
const AWSAccount = require('s3rver/lib/models/account');

const { S3_ACCESS_KEY: key, S3_SECRET_KEY: secret, S3_BUCKET: bucket } = process.env;
if (!key || !secret || !bucket) {
  console.error('s3: set S3_ACCESS_KEY, S3_SECRET_KEY and S3_BUCKET (see compose/.env.example)');
  process.exit(2);
}
AWSAccount.DUMMY_ACCOUNT.revokeAccessKey('S3RVER');
AWSAccount.DUMMY_ACCOUNT.createKeyPair(key, secret);
// node as a container's PID 1 has no default action for SIGTERM: without this handler `docker
// stop` and `compose down` wait out their whole timeout and then SIGKILL the server
const server = new S3rver({
  directory: process.env.S3_DIRECTORY || '/data',
  address: '0.0.0.0',
  port: Number(process.env.S3_PORT || 9000),
  vhostBuckets: false,
  silent: process.env.S3_SILENT === '1',
  configureBuckets: [{ name: bucket }],
});
server.run().then(() => console.log(`s3: serving ${process.env.S3_DIRECTORY || '/data'}, bucket ${bucket}`),
  (err) => { console.error(`s3: ${err.message}`); process.exit(1); });
for (const signal of ['SIGTERM', 'SIGINT']) {
  process.on(signal, () => {
    console.log(`s3: ${signal}: closing`);
    server.close().then(() => process.exit(0), () => process.exit(0));
    setTimeout(() => process.exit(0), 5000).unref();  // open keep-alive connections do not hold the exit
  });
}
