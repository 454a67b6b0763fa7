package gateway

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"hash"
	"strings"

	v1 "github.com/buildq/buildq/api/v1"
)

// Request ids the gateway makes are deterministic, so that a redelivered
// event or webhook becomes the same request, which JetStream's duplicate
// window (Nats-Msg-Id) stores once, on whichever replica it lands:
//
//   - a CloudEvent whose data has no requestId:
//     "ce-" + hex(sha256("cloudevent", tenant, event source, event
//     id))[:40] — the
//     CloudEvents spec makes source + id unique per distinct event;
//   - a webhook push, for each trigger it matches:
//     "gh-" (GitHub) or "gl-" (GitLab) + hex(sha256("webhook", forge,
//     tenant, push, trigger))[:40], where push is the push's own identity
//     (pushDelivery: repository, ref, before, after) and the trigger is
//     what it builds (repository, name, image, dockerfile, subPath,
//     target). No delivery header goes in: neither GitHub's signature
//     (which covers the body only) nor GitLab's token (which covers no
//     part of the request) vouches for X-GitHub-Delivery, Idempotency-Key
//     or X-Gitlab-Event-UUID, so a replayed push with a fresh header would
//     be a new build. A push is one request per trigger, however often and
//     by whomever it is delivered; the same ref update pushed again (same
//     before and after) builds the same commit, the same image, and is the
//     same request too.
//
// The prefixes "gh-" and "gl-" are reserved (reservedIDPrefix): a
// CloudEvent's data may not name such a requestId, so that no producer
// can take a webhook push's id first.
//
// Each string is hashed length-prefixed, so no two lists of parts hash
// alike.

// idHexLen is how many hex digits of the digest an id keeps (160 bits).
const idHexLen = 40

func idDigest(parts ...string) string {
	h := sha256.New()
	writeParts(h, parts)
	return hex.EncodeToString(h.Sum(nil))[:idHexLen]
}

func writeParts(h hash.Hash, parts []string) {
	var n [8]byte
	for _, p := range parts {
		binary.BigEndian.PutUint64(n[:], uint64(len(p)))
		h.Write(n[:])
		h.Write([]byte(p))
	}
}

// EventRequestID is the request id of a CloudEvent of tenant whose data
// names none.
func EventRequestID(tenant, source, id string) string {
	return "ce-" + idDigest("cloudevent", tenant, source, id)
}

// Prefixes of the request ids the gateway derives for webhook pushes.
const (
	githubIDPrefix = "gh-"
	gitlabIDPrefix = "gl-"
)

// reservedIDPrefix returns the prefix of webhook pushes' request ids that
// id starts with, or "": a CloudEvent may not name such a requestId (422).
func reservedIDPrefix(id string) string {
	for _, p := range []string{githubIDPrefix, gitlabIDPrefix} {
		if strings.HasPrefix(id, p) {
			return p
		}
	}
	return ""
}

// hookRequestID is the request id of trigger tr's build of a webhook
// push whose identity (pushDelivery) is pushID; forge is "github" or
// "gitlab".
func hookRequestID(forge, tenant, pushID string, tr Trigger) string {
	prefix := githubIDPrefix
	if forge == forgeGitLab {
		prefix = gitlabIDPrefix
	}
	return prefix + idDigest("webhook", forge, tenant, pushID, tr.key())
}

// pushDelivery is a push's own identity: its repository (the first of
// its URLs that normalizes), ref, before and after. Every field comes
// from the body: GitHub's signature covers it, GitLab's token vouches
// for its sender.
func pushDelivery(p push) string {
	urls := make([]string, 0, len(p.repoURLs))
	for _, u := range p.repoURLs {
		if n := normalizeRepo(u); n != "" {
			urls = append(urls, n)
		}
	}
	repo := ""
	if len(urls) > 0 {
		repo = urls[0]
	}
	return "push:" + idDigest(repo, p.ref, p.before, p.after)
}

// nonceLen is the length of a Nats-Msg-Id nonce, in hex digits (as the
// publisher SDK's).
const nonceLen = 20

// msgID is a request's Nats-Msg-Id, v1.RequestMsgID(tenant, requestID,
// nonce) with nonce = HMAC-SHA256(key, tenant/requestID): unpredictable
// to anyone without the key (so no other tenant can publish the header
// first and have JetStream drop the request), the same on every replica
// and across retries (so a redelivery is a duplicate).
func msgID(key []byte, tenant, requestID string) string {
	m := hmac.New(sha256.New, key)
	writeParts(m, []string{"buildq-gateway-msgid", tenant, requestID})
	return v1.RequestMsgID(tenant, requestID, hex.EncodeToString(m.Sum(nil))[:nonceLen])
}
